"""The optimizer overlapped with communication: `ddp.overlap_optimizer(opt)`.

Each bucket's parameters are stepped by `opt` as soon as the bucket's
gradients are reduced and written back, while later buckets are still being
reduced; the user's `opt.step()` then steps only the parameters the backward
did not (none, usually). The C++ side, which calls `OptimizerOverlap.step_bucket`
bucket after bucket on the thread that called backward, is Note [Stepping
reduced buckets] in reducer/finish/step_per_bucket.h.

Note [Exact overlapped steps]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A parameter ends up exactly as with a plain `opt.step()` after backward
because:
 - when a bucket is stepped its parameters' .grad are final: the reduced
   average is written back (the same write-back, split by bucket), and
   nothing else writes .grad before `opt.step()` (the user must not either:
   no clipping, unscaling or editing of gradients between backward and
   step).
 - the step of a subset is the step of its parameters: the bucket is
   stepped through a view of `opt` whose groups hold the bucket's
   parameters only, each with its group's hyperparameters, lr included
   (Note [Stepping a view of the optimizer]), and
   torch.optim's optimizers (all but LBFGS, which needs a closure) update
   each parameter from its own gradient and state alone, so splitting the
   parameters between calls changes no bit. An optimizer that mixes
   parameters (a global norm, a trust ratio over all parameters) is not
   exact here: users must not overlap one.
 - every parameter is stepped once per optimizer.step(): the parameters
   stepped in the backward are remembered and left out of the next
   `opt.step()`, which steps the others (those in no bucket the backward
   reduced, e.g. after a static graph's first iteration or a parameter the
   wrapper does not reduce because it has no gradient to reduce). A second
   synchronising backward before `opt.step()` would step them twice (where
   the plain order sums both gradients into one step): it is refused, at its
   first bucket, before anything is stepped.
The per-bucket step calls the optimizer class's step without the step hooks
of torch.optim (a pre- or post-hook would run once per bucket): an
optimizer with step hooks (other than the overlap's own) is refused.

With a communication hook (compression, PowerSGD, ddp_ext's adaptive
precision) a bucket's .grad are what the hook's future returned, written
back once the future completes, as without overlap: the step comes after
that, so it steps the same gradients. The hook must not read or write
parameters (a later bucket's hook may run while an earlier bucket is
stepped); torch's hooks that step parameters themselves (ZeRO's, the fused
optimizers') are refused.

Note [Hyperparameters fixed at the backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A bucket stepped inside the backward is stepped with its group's values
(lr, weight_decay, betas, momentum, any key) as they are then; a plain step
uses them as they are at optimizer.step(). A change in between (a warm-up
written as `g["lr"] = ...` just before the step, a scheduler stepped before
the optimizer) cannot be undone in the steps already applied, so it is
refused: the groups (the dicts) and copies of their values are kept at the
backward's first stepped bucket, and optimizer.step() raises, before
stepping anything, if a group was removed or replaced or a value differs.
The first synchronising backward steps nothing (Note [Gradients edited
before the step]), so a loop that changes them every iteration is refused
there with nothing applied. A group added since (add_param_group) is no
change: its parameters were in no group, so the backward stepped none of
them, and optimizer.step() steps them with the new group's values, as a
plain step does (pending ones, Note [Stepping in the next forward], with
the values of that step). Changes after optimizer.step() (an LR scheduler's
step) reach the next backward's steps, as they reach the next plain step.

The check is local, with no collective. A loop changes its groups from
what every rank shares (the iteration, a schedule), so every rank finds the
same change at the same step and raises the same error. A change made on
some ranks only trains the replicas apart in the plain loop as well (torch's
DDP is silent about it): there the ranks that made it raise, and the others,
whose steps used values that did not change, are exact and go on to their
next collective, which cannot complete without the ranks that stopped (the
hang diagnosis names them, docs/DIAGNOSIS.md). Agreeing on it at every step
would cost a collective per optimizer.step() for a loop that is wrong
without the overlap too.

Note [Gradients edited before the step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Clipping by the global norm, GradScaler (unscaling, skipping a step with
infinities) and any edit of .grad between backward and optimizer.step()
change what a plain step does, and cannot happen before the overlapped
steps, which come first. They are refused: every in-place change through
autograd's ops bumps a tensor's version counter, so the .grad of each
reduced parameter (the tensor and its version) is remembered when its
bucket is written back, and optimizer.step() raises if any changed.
GradScaler's unscale_ kernel does not bump versions: a step called from
GradScaler's own functions (found among the callers) is refused as such. To
refuse before anything is applied, the first synchronising backward after
overlap_optimizer steps nothing and only remembers: its optimizer.step()
either raises (nothing stepped) or steps every parameter as a plain step
does, and the overlap starts with the next backward. A loop that edits
gradients only later (clipping after a warm-up) is refused at that step,
with the backward's steps applied: the error says so. GradScaler with an
optimizer that handles scaling itself (fused) is seen by the grad_scale
attribute it sets on the optimizer before stepping.
"""

import sys
import types
from typing import Dict, List, Optional, Tuple

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ddp_ext._forward_tail import ForwardTail
from ddp_ext._gradient_edits import GradientEdits
from ddp_ext._hyperparameters import GroupValues, of_group

_MAX_NAMED = 5
# Above the step pre-hook: torch.optim's step wrapper, maybe an LR
# scheduler's, then GradScaler's _maybe_opt_step.
_CALLERS_SEARCHED = 4


def _error(rank: int, what: str) -> str:
    return f"DistributedDataParallel on rank {rank}: overlap_optimizer {what}"


def shown_names(names: List[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMED])
    return shown + (f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else "")


# Why step hooks are refused, by mode: the backward's steps, or the sharded step.
_HOOKS_PER_BUCKET = ("the backward steps each bucket separately, so a hook would run once per bucket. Remove the "
                     "hooks, or step without overlap_optimizer.")
_HOOKS_AROUND_SHARDS = ("optimizer.step() steps this rank's shard in a pre-hook of its own, so another pre-hook runs "
                        "before or after the step depending on when it was registered, and a hook sees only this "
                        "rank's shard of the gradients (and, with overlap_forward, parameters still being "
                        "gathered). Remove the hooks, or step without shard=True.")


def hooked_step_refusal(optimizer, own: Optional[int] = None, sharded: bool = False) -> str:
    """Why `optimizer`'s step hooks (but the overlap's own pre-hook, of handle id `own`) are refused,
    by the overlap or (`sharded`) the sharded optimizer."""
    hooks = []
    if any(key != own for key in optimizer._optimizer_step_pre_hooks) or _global_optimizer_pre_hooks:
        hooks.append("pre-hooks")
    if optimizer._optimizer_step_post_hooks or _global_optimizer_post_hooks:
        hooks.append("post-hooks")
    if not hooks:
        return ""
    return (
        f"cannot step an optimizer with step {' and '.join(hooks)} registered (register_step_pre_hook, "
        "register_step_post_hook or torch.optim.optimizer.register_optimizer_step_pre_hook/post_hook): "
        f"{_HOOKS_AROUND_SHARDS if sharded else _HOOKS_PER_BUCKET}"
    )


# Note [Stepping a view of the optimizer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The overlap steps subsets of the parameters: a bucket in the backward,
# the parameters left to optimizer.step(), the pending ones with the values
# of an earlier step. It never changes the user's optimizer for that: it
# steps a view, an object of the optimizer's class sharing its attributes
# (state, defaults, hooks) but with param_groups of its own, copies of the
# groups with the subset as their parameters (and the given values), the
# groups with none left out. The optimizer's steps write per-parameter
# state into the shared `state`, so the view's step is the optimizer's.
# (A value an optimizer wrote into its group during the step would be lost
# with the copy; torch.optim's do not write any.) optimizer.step() itself
# is not replaced: the overlap's step pre-hook hands torch.optim's step
# wrapper the view in place of the optimizer, so the hooks and the LR
# scheduler's count run as usual, and nothing is left to restore if the
# step raises. The pre-hook does nothing for a view (a subclass's step that
# calls super().step() runs the hooks again, with the view).


def _view(optimizer, per_group: Dict[int, List[torch.Tensor]], hyperparameters: Optional[List[dict]] = None):
    """`optimizer` with group i's parameters `per_group[i]` (groups with none
    left out), and `hyperparameters[i]`'s values where given: Note [Stepping
    a view of the optimizer]."""
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    groups = []
    for number, group in enumerate(optimizer.param_groups):
        params = per_group.get(number)
        if params:
            values = hyperparameters[number] if hyperparameters is not None and number < len(hyperparameters) else {}
            groups.append({**group, **values, "params": params})
    view.param_groups = groups
    return view


def _unhooked_step(optimizer):
    """The optimizer class's step without torch.optim's hook-running wrapper
    (Optimizer._patch_step_function), bound to `optimizer` (a view)."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return types.MethodType(step, optimizer)


_EDITS_LOST = (
    "With overlap_optimizer the backward steps each bucket's parameters as soon as it is reduced, before any such "
    "change, which would be lost. Clip, scale or edit gradients without overlap_optimizer.")
_GRAD_SCALER = (
    "cannot step through a GradScaler (scaler.step(optimizer)): the backward steps each bucket's parameters as "
    "soon as it is reduced, before the scaler unscales the gradients or skips a step with infinities. Use "
    "GradScaler without overlap_optimizer.")


# Note [Stepping in chunks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A foreach optimizer allocates its temporaries (Adam: the denominators,
# the updates) for every parameter it steps in one call: for a plain step
# after backward, the size of the model again, on top of the gradients, at
# the iteration's peak. The overlapped steps are split anyway (Note [Exact
# overlapped steps]), so each bucket is stepped in chunks of at most
# STEP_CHUNK_BYTES of parameters (a larger parameter alone), in the
# bucket's order: the temporaries are those of one chunk, and the result is
# the same, for the reason that splitting by bucket is exact. Each call
# costs a little Python; 4 MiB keeps a default 25 MiB bucket to about 7.
STEP_CHUNK_BYTES = 4 * 2**20


def _chunks(params: List[torch.Tensor], limit: int) -> List[List[torch.Tensor]]:
    """`params` in order, cut into runs of at most `limit` bytes (a larger parameter alone)."""
    chunks, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        chunks.append(current)
    return chunks


def _called_by_grad_scaler(optimizer) -> bool:
    """Whether optimizer.step() is being called by a GradScaler's step: one
    of its functions is among the callers (its unscale_ changes .grad without
    bumping their versions), or it set the scale on a fused optimizer."""
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return True
    frame = sys._getframe(2)  # above the step pre-hook
    for _ in range(_CALLERS_SEARCHED):
        if frame is None:
            return False
        if frame.f_code.co_filename == torch.amp.grad_scaler.__file__:
            return True
        frame = frame.f_back
    return False


def _left_out():
    return None


class OptimizerOverlap:
    """One wrapper's overlapped optimizer: steps the buckets the reducer
    hands it, and the rest at optimizer.step(). Given the reducer, the
    optimizer, the reducer's parameters and the settings; holds neither the
    wrapper nor the reducer (the reducer holds `step_bucket`). A pickled or
    deep-copied wrapper has none (its reducer is new): it pickles as None."""

    def __reduce__(self):
        return (_left_out, ())

    def __init__(self, reducer, optimizer, named: List[Tuple[str, torch.Tensor]], rank: int,
                 overlap_forward: float = 0.0):
        """`named`: the reducer's parameters, in its order (its indices)."""
        self.rank = rank
        self.optimizer = optimizer
        self.params = [p for _, p in named]
        self.names = {id(p): name for name, p in named}
        # Stepped by a backward since the last optimizer.step(), by id.
        self.stepped: Dict[int, torch.Tensor] = {}
        # Reduced by a backward since the last optimizer.step(): Note [Gradients edited before the step].
        self.reduced = GradientEdits()
        self.probing = True  # the first synchronising backward steps nothing: the same Note
        self.step_chunk_bytes = STEP_CHUNK_BYTES  # Note [Stepping in chunks]
        self.backward_reduced = False  # a synchronising backward reduced buckets since the last step
        # The groups' values when that backward stepped: Note [Hyperparameters fixed at the backward].
        self.stepped_with: Optional[GroupValues] = None
        # Where each parameter is in param_groups, by id: (group, position);
        # recomputed when the groups change (load_state_dict, add_param_group).
        self._places: Dict[int, Tuple[int, int]] = {}
        self._places_of = None
        # Note [Stepping a view of the optimizer].
        self._step_hook = optimizer.register_step_pre_hook(self.before_step)
        optimizer._ddp_ext_overlapped = True
        reducer._set_bucket_step(self.step_bucket)
        # See Note [Stepping in the next forward] in ddp_ext/_forward_tail.py: the
        # tail holds the buckets; what their parameters owe is kept here.
        self.tail = ForwardTail(reducer, self.params, overlap_forward, self._finished) if overlap_forward else None
        self.owed = False  # optimizer.step() ran: the pending parameters are stepped when finished
        self.owed_values: Optional[List[dict]] = None  # the groups' values at that step
        self.zero_to_none: Optional[bool] = None  # a zero_grad() after that step
        if self.tail is not None:
            self._wrap_for_tail(optimizer)

    def _wrap_for_tail(self, optimizer) -> None:
        """state_dict() and load_state_dict() finish every pending step first
        (their pre-hooks); zero_grad() leaves pending gradients to their
        steps (Note [zero_grad replaced])."""
        tail, user_zero_grad, overlap = self.tail, optimizer.zero_grad, self
        optimizer.register_state_dict_pre_hook(lambda opt: tail.finish_all())
        optimizer.register_load_state_dict_pre_hook(lambda opt, state: tail.finish_all())

        # Note [zero_grad replaced]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~
        # torch.optim has no hook on zero_grad, and a plain zero_grad() reads
        # every gradient, pending ones included: each read would wait for its
        # bucket, and the forward overlap would be gone. So the optimizer's
        # zero_grad is replaced (an attribute of the instance): while steps
        # are owed it zeroes a view without the pending parameters (Note
        # [Stepping a view of the optimizer]) and leaves them to be zeroed
        # right after their step; otherwise it is the user's zero_grad.
        def zero_grad(opt, set_to_none: bool = True):
            if not (tail.pending and overlap.owed):
                return user_zero_grad(set_to_none)
            if getattr(user_zero_grad, "__self__", None) is not opt:
                return user_zero_grad(set_to_none)  # someone's wrapper: it reads, and so finishes, everything
            overlap.zero_to_none = bool(overlap.zero_to_none) or set_to_none
            rest = {number: [p for p in group["params"] if id(p) not in tail.pending]
                    for number, group in enumerate(opt.param_groups)}
            return user_zero_grad.__func__(_view(opt, rest), set_to_none)

        optimizer.zero_grad = types.MethodType(zero_grad, optimizer)

    def forward_begins(self, module) -> None:
        if self.tail is not None:
            self.tail.forward_begins(module)

    def forward_done(self, synchronising: bool) -> None:
        """The end of the wrapper's forward (before the next backward can reuse a bucket)."""
        if self.tail is not None:
            self.tail.forward_done(synchronising)

    def finish_forward_tail(self) -> None:
        if self.tail is not None:
            self.tail.finish_all()

    @property
    def overlaps_forward(self) -> bool:
        return self.tail is not None

    def check_regroup(self) -> None:
        """Raises if the process group may not change now: buckets are still on the wire."""
        if self.tail is not None and self.tail.pending:
            raise RuntimeError(
                f"DistributedDataParallel on rank {self.rank} cannot change its process group while buckets of the "
                "last backward are still being reduced for the forward overlap (overlap_optimizer(..., "
                "overlap_forward=True)): call ddp.finish_forward_tail() first")

    def _finished(self, members: List[torch.Tensor]) -> None:
        """The tail finished a bucket of these parameters: their gradients are written back."""
        if not self.owed:
            self.reduced.remember(members)  # now as any reduced gradient
            return
        self.step_owed(members, self.owed_values)
        if self.zero_to_none is not None:
            _zero(self.in_groups(members), self.zero_to_none)  # zero_grad() reaches its groups only

    def _refuse_if_changed(self) -> None:
        """What was checked at overlap_optimizer but may have been added
        since: step hooks. (A communication hook that steps parameters is
        refused when it is registered: BackwardSteps.check_stepping_hook.)"""
        refusal = hooked_step_refusal(self.optimizer, own=self._step_hook.id)
        if refusal:
            raise RuntimeError(_error(self.rank, refusal))

    def step_bucket(self, indices: List[int]) -> None:
        """Called by the reducer, without its lock, when the bucket of these
        parameters has been reduced and written back."""
        if self.tail is not None and self.tail.after_backward_bucket():
            self.owed, self.owed_values, self.zero_to_none = False, None, None
        self._refuse_if_changed()
        places = self._placed()
        bucket = {id(p): p for p in (self.params[i] for i in indices) if id(p) in places}
        if not bucket:
            return
        if not self.backward_reduced:
            self.stepped_with = GroupValues(self.optimizer.param_groups)
        self.backward_reduced = True
        if any(key in self.reduced for key in bucket):
            # This backward writes the gradients back all the same: not an edit of the user's.
            self.reduced.forget()
            raise RuntimeError(_error(
                self.rank, "reduced these parameters' gradients in a synchronising backward already, and "
                "optimizer.step() has not run since: a second synchronising backward before optimizer.step() "
                "would step them twice, where without overlap_optimizer their gradients add up into one step. "
                "Accumulate gradients inside ddp.no_sync() (every backward but the last), or call "
                "optimizer.step() after every synchronising backward. Nothing was stepped in this backward."))
        if self.probing:
            self.reduced.remember(bucket.values())
            return
        for chunk in self._stepped_in_chunks(list(bucket.values()), places):
            self.stepped.update((id(p), p) for p in chunk)
            self.reduced.remember(chunk)

    def _stepped_in_chunks(self, params: List[torch.Tensor], places, hyperparameters=None):
        """Steps `params` chunk after chunk (Note [Stepping in chunks]), yielding each chunk once stepped."""
        for chunk in _chunks(params, self.step_chunk_bytes):
            per_group: Dict[int, List[Tuple[int, torch.Tensor]]] = {}
            for p in chunk:
                number, position = places[id(p)]
                per_group.setdefault(number, []).append((position, p))
            in_order = {number: [p for _, p in sorted(pairs, key=lambda pair: pair[0])]
                        for number, pairs in per_group.items()}
            _unhooked_step(_view(self.optimizer, in_order, hyperparameters))()
            yield chunk

    def in_groups(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        places = self._placed()
        return [p for p in params if id(p) in places]

    def step_owed(self, params: List[torch.Tensor], hyperparameters: List[dict]) -> None:
        """Steps pending parameters whose bucket is now reduced, as the
        user's step would have (Note [Stepping in the next forward])."""
        places = self._placed()
        for _ in self._stepped_in_chunks([p for p in params if id(p) in places], places, hyperparameters):
            pass

    def _applied(self) -> str:
        if not self.stepped:
            return " Nothing was stepped."
        return (f" The backward had stepped {len(self.stepped)} parameters already with the gradients as reduced; "
                "the others were not stepped.")

    def _refuse_changed_hyperparameters(self) -> None:
        """Note [Hyperparameters fixed at the backward]."""
        changes = self.stepped_with.changes(self.optimizer.param_groups) if self.stepped_with is not None else []
        if not changes:
            return
        if self.stepped:
            applied = (f" The backward had stepped {len(self.stepped)} parameters already, with the values as they "
                       "stood then (before each arrow); those steps are applied, and this optimizer.step() stepped "
                       "nothing.")
        else:
            applied = " Nothing was stepped."
        raise RuntimeError(_error(
            self.rank, f"found the optimizer's param groups changed between backward() and optimizer.step(): "
            f"{shown_names(changes)}. With overlap_optimizer the backward steps each bucket's parameters as soon as it "
            f"is reduced, with the param groups' values as they are then.{applied} Set learning rates and other "
            "group values before the backward (before the forward, say), or use an LR scheduler whose step() is "
            "called after optimizer.step()."))

    def _placed(self) -> Dict[int, Tuple[int, int]]:
        groups = self.optimizer.param_groups
        layout = [(id(group), id(group["params"]), len(group["params"])) for group in groups]
        if layout != self._places_of:
            self._places = {id(p): (number, position) for number, group in enumerate(groups)
                            for position, p in enumerate(group["params"])}
            self._places_of = layout
        return self._places

    def before_step(self, optimizer, args, kwargs):
        """The step pre-hook of the user's optimizer.step(): it steps the
        parameters no backward stepped since the last call (all of them when
        none did), through a view handed on in place of the optimizer."""
        if optimizer is not self.optimizer:
            return None  # a view: Note [Stepping a view of the optimizer]
        if any(a is not None for a in args[1:]) or any(v is not None for v in kwargs.values()):
            raise ValueError(_error(
                self.rank, "runs optimizer.step() without a closure only (a closure would run backward, and "
                "step buckets, from inside the step)."))
        self._refuse_if_changed()
        if _called_by_grad_scaler(self.optimizer):
            raise RuntimeError(_error(self.rank, _GRAD_SCALER + self._applied()))
        edited = self.reduced.edited()
        if edited:
            names = [self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}") for p in edited]
            raise RuntimeError(_error(
                self.rank, f"found the gradients of {shown_names(names)} changed between backward() and "
                f"optimizer.step(), by clipping (clip_grad_norm_) or another change. "
                f"{_EDITS_LOST}{self._applied()}"))
        self._refuse_changed_hyperparameters()
        if self.probing and self.backward_reduced and self.tail is not None:
            self.tail.start()
        self.probing = self.probing and not self.backward_reduced
        self.backward_reduced = False
        self.stepped_with = None
        self.reduced.forget()
        stepped, self.stepped = self.stepped, {}
        pending = self.tail.pending if self.tail is not None else {}
        if pending:  # Note [Stepping in the next forward]
            self.owed = True
            self.owed_values = [of_group(group) for group in self.optimizer.param_groups]
        if not stepped and not pending:
            return None
        rest = {number: [p for p in group["params"] if id(p) not in stepped and id(p) not in pending]
                for number, group in enumerate(self.optimizer.param_groups)}
        # Nothing left, the usual case: the view has no group, and its step does nothing.
        return (_view(self.optimizer, rest), *args[1:]), kwargs


def _zero(params: List[torch.Tensor], set_to_none: bool) -> None:
    """What optimizer.zero_grad() does to these parameters' gradients."""
    for p in params:
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()
