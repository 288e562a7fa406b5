"""The optimizer sharded across the ranks, inside the drop-in:
`ddp.overlap_optimizer(opt, shard=True)` (ZeRO-2).

Each bucket is reduce-scattered instead of all-reduced, by the reducer
(Note [Sharded buckets] in reducer/transport/reduce_scatter.h; the ranges:
Note [Shard plan] in ddp_ext/_shard_plan.py); at optimizer.step() each rank
steps its shard only, with an inner optimizer of the user's class, then the
buckets' parameters are all-gathered. The optimizer's state exists for the
shard only.

Note [Exact sharded steps]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A parameter ends up bitwise as with a plain optimizer.step() after torch's
DDP (over Gloo at any world size; over NCCL at 2 ranks, below) because:
 - the gradient: each bucket is scaled by 1/world_size as it is copied in
   (the same product as the default reduction, Note [Gradient averaging] in
   reducer/base/averaging.h) and reduced by the reducer (Note [Sharded
   buckets] in reducer/transport/reduce_scatter.h): over Gloo allreduced in
   place as the default allreduces it, each rank keeping its range, so the
   same sums in the same order; over NCCL reduce-scattered, which at 2
   ranks is a sum of two, the same in any order, and at more may add in
   another order than the allreduce (the last bits may differ).
 - the step: the optimizers admitted update each element from its own
   gradient and state alone (Note [Elementwise optimizers] in
   ddp_ext/_shard_admission.py), so stepping a
   piece of a parameter gives the bits the whole parameter's step gives to
   those elements; torch.optim's kernels give the same bits for a slice at
   any offset (tests/sharding checks them against plain steps).
 - the values: each group's hyperparameters are read at optimizer.step(),
   as a plain step reads them; the pieces are stepped through a view of the
   user's optimizer (Note [Stepping a view of the optimizer] in
   ddp_ext/_optimizer_overlap.py) whose state is the shard's.
 - the all-gather copies the stepped bits to every rank unchanged.
A parameter no rank used (find_unused_parameters) is not handed over by
the reducer, on any rank: its .grad stays as it was, and its pieces are not
stepped, as a plain step skips it.

Note [Stepping the shard]
~~~~~~~~~~~~~~~~~~~~~~~~~
At optimizer.step() the step pre-hook, for each bucket the last
synchronising backward reduced: where the parameters live in the bucket's
storage (Note [Parameters in the bucket's storage] in
ddp_ext/_shard_plan.py; a settled layout), the flat shard is the rank's
range of it; elsewhere it copies the rank's elements of the parameters
into the bucket's flat shard (in case they were changed since: a loaded
checkpoint). It points each piece's .grad at its range of the reducer's
shard of the bucket (the averaged gradient), steps the pieces a group of
buckets at a time, and launches each group's all-gathers of the flat shards
as soon as it is stepped (Note [Pipelined steps and all-gathers]): in place
into the bucket's storage, or
through the gather buffers, at most two buckets' at a time, copied into
the parameters (with overlap_forward, returns with every in-place one and
the last two others on the wire: Note [Gathering behind the next forward]
in ddp_ext/_gather_tail.py). The
pre-hook then hands torch.optim's step wrapper a view of
the optimizer with the parameters no bucket reduced (frozen ones, say), so
hooks and an LR scheduler's count run as usual.

After a synchronising backward a parameter's .grad is a ShardGradient
(Note [Gradients after a sharded backward] in ddp_ext/_shard_gradient.py),
which refuses to be read or changed; one replaced or set to None before
the step is refused there, as with the overlap (Note [Gradients edited
before the step] in ddp_ext/_optimizer_overlap.py).
"""

import time
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ddp_ext._bucket_storage import BucketStorage
from ddp_ext._gather_tail import GatherTail
from ddp_ext._gradient_edits import GradientEdits
from ddp_ext._optimizer_overlap import (_called_by_grad_scaler, _unhooked_step, _view, hooked_step_refusal,
                                        shown_names)
from ddp_ext._shard_gradient import ShardGradient, drop_zeroed
from ddp_ext._sharded_clip import GlobalNorm, scale_by_norm
from ddp_ext._shard_plan import SCALAR_STATE, ShardPlan, replicates
from ddp_ext._shard_recut import recut

# torch 2.13 renamed all_gather_into_tensor (the old name warns).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# The all-gathers' buffers, reused from step to step, for the buckets whose
# parameters are not in the bucket's storage (Note [Parameters in the
# bucket's storage] in ddp_ext/_shard_plan.py): at most this many of those
# buckets' all-gathers are on the wire, or held behind the next forward, at once.
GATHER_BUFFERS = 2

# Note [Sharding over several hosts]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Where the wrapper would reduce over a hierarchical twin of its group
# (hierarchical_allreduce, ddp_ext/hierarchy.py: torchrun's several hosts of
# several ranks), sharding gives the reducer back the flat group: the
# reduce-scatter and the replicated buckets' allreduces sum in the order of
# torch's DDP's flat allreduce (Note [Exact sharded steps]), which the
# twin's host-first sums would not. The all-gathers only copy, so they run
# over the twin (Note [Hierarchical all-gather] in
# process_groups/hierarchical/backend.h): each shard crosses a host's link
# once, (H - 1)/H of a bucket per host instead of a ring's (W - 1)/W, with
# the same bits.

# Note [Pipelined steps and all-gathers]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# optimizer.step() steps the buckets' shards in groups, first layers' first,
# and launches a group's all-gathers as soon as it is stepped, so the link
# carries the first layers' parameters while the later groups step. A group
# is the next buckets in that order until their shards hold STEP_GROUP_BYTES
# (a larger bucket alone): one call of the inner optimizer per group, since
# each call costs a little Python (a foreach Adam call, about 50 us on this
# project's CPU machine, against about 100 us to step 256 KiB). The result
# is the same bits as one call for all the shards (Note [Exact sharded
# steps]): the optimizers admitted update each element from its own gradient
# and state, each piece has its own state (Adam's `step` counter included)
# and is stepped once, every call reads the groups' values as they are at
# optimizer.step(), and a bucket's all-gather is launched only once its
# shard is stepped and reads nothing another group's step writes (each
# bucket has its own shard, and its own storage or gather buffer).
STEP_GROUP_BYTES = 256 * 2**10


def step_groups(plans: List[ShardPlan]) -> List[List[ShardPlan]]:
    """`plans` in order, cut into groups whose shards hold at least
    STEP_GROUP_BYTES (the last one less): Note [Pipelined steps and all-gathers]."""
    groups, current, size = [], [], 0
    for plan in plans:
        current.append(plan)
        size += plan.params.numel() * plan.params.element_size()
        if size >= STEP_GROUP_BYTES:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


class ShardedOptimizer:
    """One wrapper's sharded optimizer: what the reducer's reduce-scatter hands
    over (step_bucket), the shard plans, the inner state, and the step. Holds
    neither the wrapper nor the reducer. A pickled or deep-copied wrapper has
    none."""

    reduce_scatters = True  # the reducer reduce-scatters: no communication hook may replace it

    def __reduce__(self):
        return (type(None), ())

    def __init__(self, optimizer, named: List[Tuple[str, torch.Tensor]], group, device,
                 overlap_forward: bool = False, shard_min_bytes: int = 0, gather_group=None):
        self.optimizer = optimizer
        self.shard_min_bytes = shard_min_bytes  # smaller buckets are replicated: Note [Replicated plans]
        self.group = group
        self.gather_group = group if gather_group is None else gather_group  # Note [Sharding over several hosts]
        self.rank = group.rank()
        self.world_size = group.size()
        self.device = device
        self.params = [p for _, p in named]
        self.names = {id(p): name for name, p in named}
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.plans: Dict[Tuple, ShardPlan] = {}  # by layout
        self.reduced: Dict[Tuple, ShardPlan] = {}  # by layout: reduced since the last step
        self.used: set = set()  # the reducer indices some rank used in those backwards
        self.active: Optional[frozenset] = None  # the layouts the state is sharded by
        self.state: Dict[torch.Tensor, dict] = defaultdict(dict)  # the inner optimizer's, by piece
        self.loaded: Dict[int, dict] = {}  # unsharded state not yet cut into pieces, by reducer index
        self.edits = GradientEdits()
        self.clipped = False
        self._step_hook = optimizer.register_step_pre_hook(self.before_step)
        optimizer.register_state_dict_post_hook(self._state_dict_post)
        optimizer.register_load_state_dict_post_hook(self._load_state_dict_post)
        optimizer._ddp_ext_overlapped = True
        self.reshards = 0  # how often a new layout made the state be cut again
        self.reshard_seconds = 0.0  # the time those took
        # Note [Gathering behind the next forward] in ddp_ext/_gather_tail.py.
        self.gathering: Dict[int, Tuple[ShardPlan, torch.Tensor, object]] = {}  # by the tail's key
        self.gathers = 0  # all-gathers launched: each one's key
        self.gather_buffers: Dict[Tuple, List[torch.Tensor]] = {}  # GATHER_BUFFERS per dtype and device, reused
        self.keep_buffers = True  # False: dropped at the next forward
        # Note [Parameters in the bucket's storage] in ddp_ext/_shard_plan.py.
        self.storage = BucketStorage(self.params, self.names, self.rank)
        self.tail = GatherTail(self._write_gathered) if overlap_forward else None
        if self.tail is not None:
            optimizer.register_state_dict_pre_hook(lambda opt: self.finish_forward_tail())
            optimizer.register_load_state_dict_pre_hook(lambda opt, state: self.finish_forward_tail())
        self._load_state_dict_post(optimizer)  # state loaded before the line

    # --- the wrapper's interface of an overlap: the all-gathers' tail --------

    @property
    def overlaps_forward(self) -> bool:
        return self.tail is not None

    def forward_begins(self, module) -> None:
        drop_zeroed(self.params)  # Note [Gradients after a sharded backward]
        if not self.keep_buffers:
            self.gather_buffers = {}
            self.keep_buffers = True
        if self.tail is not None:
            self.tail.forward_begins(module)

    def forward_done(self, synchronising: bool) -> None:
        if self.tail is not None:
            self.tail.forward_done(synchronising)

    def finish_forward_tail(self) -> None:
        if self.tail is not None:
            self.tail.finish_all()

    def check_regroup(self) -> None:
        raise RuntimeError(
            f"DistributedDataParallel on rank {self.rank} cannot change its process group with overlap_optimizer("
            "..., shard=True): the optimizer's state is sharded across the ranks of the group.")

    def _error(self, what: str) -> str:
        return f"DistributedDataParallel on rank {self.rank}: overlap_optimizer(..., shard=True) {what}"

    # --- the backward: what the reducer's reduce-scatter hands over ----------

    def step_bucket(self, used: List[int], members: List[int], offsets: List[int], lengths: List[int],
                    length: int, shard: Optional[torch.Tensor]) -> None:
        """The reducer's end of a backward, per bucket (Note [Sharded buckets]
        in reducer/transport/reduce_scatter.h): `used` are its parameters
        some rank used, `shard` the rank's averaged gradient of the bucket.
        Gives those parameters a ShardGradient as .grad (Note [Gradients
        after a sharded backward] in ddp_ext/_shard_gradient.py)."""
        if shard is None:
            return  # not reduced (unused by every rank, skip_all_reduce_unused_params)
        layout = tuple(zip(members, offsets, lengths))
        plan = self.plans.get(layout)
        if plan is None:
            replicated = replicates(length, shard.element_size(), self.world_size, self.shard_min_bytes)
            plan = ShardPlan(layout, length, shard.dtype, shard.device, self.rank, self.world_size, replicated)
            self.plans[layout] = plan
            self.gather_buffers = {}  # sized for the old buckets (none is in use in a backward)
        if shard.numel() != plan.shard:
            raise RuntimeError(self._error(
                f"received a shard of {shard.numel()} elements for a bucket of {length} elements whose plan holds "
                f"{plan.shard}: the reducer and the optimizer disagree on shard_min_bytes."))
        plan.grad = shard
        self.reduced[layout] = plan
        self.used.update(used)
        for index in used:
            p = self.params[index]
            p.grad = ShardGradient(p, self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}"))
        self.edits.remember(self.params[index] for index in used)

    # --- optimizer.step() -------------------------------------------------------

    def before_step(self, optimizer, args, kwargs):
        """The user's optimizer.step(): Note [Stepping the shard]."""
        if optimizer is not self.optimizer:
            return None  # a view
        self.finish_forward_tail()  # the last step's parameters, before anything reads them
        if any(a is not None for a in args[1:]) or any(v is not None for v in kwargs.values()):
            raise ValueError(self._error("runs optimizer.step() without a closure only."))
        refusal = hooked_step_refusal(optimizer, own=self._step_hook.id, sharded=True)
        if refusal:
            raise RuntimeError(self._error(refusal))
        if _called_by_grad_scaler(optimizer):
            raise RuntimeError(self._error(
                "cannot step through a GradScaler (scaler.step(optimizer)): each rank holds only its shard of the "
                "gradients, so the scaler's check for infinities would differ between ranks. Nothing was stepped."))
        self._refuse_edits()
        places = self._places()
        if not self.reduced:
            stale = [self.names[id(p)] for p in self.params if p.grad is not None and id(p) in places]
            if stale:
                raise RuntimeError(self._error(
                    f"found gradients ({shown_names(stale)}) but no synchronising backward since the last "
                    "optimizer.step(): each rank steps its shard of the averaged gradient, which only a "
                    "synchronising backward (outside no_sync) gives. Nothing was stepped."))
        plans = sorted(self.reduced.values(), key=lambda plan: min(index for index, _, _ in plan.layout))
        used, self.used = self.used, set()
        self.reduced = {}
        self.edits.forget()
        self.clipped = False
        settled = self._reshard([plan.layout for plan in plans])
        self._move_state(self.storage.place(plans, self.plans.values(), settled))
        self._step_and_gather(plans, places, used, settled)
        # Buckets laid out anew are often laid out again (the rebuild after the
        # first iteration): their buffers go at the next forward, once Gloo's
        # threads let go of the all-gathers.
        self.keep_buffers = settled
        stepped = {id(self.params[piece_index]) for plan in plans for piece_index, _, _ in plan.layout}
        rest = {number: [p for p in group["params"] if id(p) not in stepped]
                for number, group in enumerate(optimizer.param_groups)}
        return (_view(optimizer, rest), *args[1:]), kwargs

    def _refuse_edits(self, elsewhere: bool = False) -> None:
        """Raises if a gradient was edited here (or, `elsewhere`, on another rank)."""
        edited = self.edits.edited()
        if edited or elsewhere:
            names = [self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}") for p in edited]
            raise RuntimeError(self._error(
                f"found the gradients of {shown_names(names) if names else 'parameters on another rank'} changed "
                "between backward() and optimizer.step() "
                "(clip_grad_norm_, a GradScaler's unscale_ or another change): each rank holds only its shard of "
                "the averaged gradient, so a norm or a check of .grad differs between ranks. Clip with "
                "ddp.clip_grad_norm_(max_norm), which uses the whole gradient's norm. Nothing was stepped."))

    def _places(self) -> Dict[int, int]:
        """The param group of each of the optimizer's parameters, by id."""
        return {id(p): number for number, group in enumerate(self.optimizer.param_groups) for p in group["params"]}

    def _step(self, plans: List[ShardPlan], places: Dict[int, int], used: set) -> None:
        """Steps the shards of `plans` (one group: Note [Pipelined steps and all-gathers]) in one call."""
        per_group: Dict[int, List[torch.Tensor]] = {}
        for plan in plans:
            for piece in plan.pieces:
                p = self.params[piece.index]
                number = places.get(id(p))
                if plan.storage is None:
                    piece.flat.copy_(p.detach().reshape(-1)[piece.start:piece.stop])
                if number is None or piece.index not in used:
                    piece.flat.grad = None
                    continue
                piece.flat.grad = plan.grad[piece.at:piece.at + piece.stop - piece.start]
                per_group.setdefault(number, []).append(piece.flat)
            self._cut_loaded(plan)
        if per_group:
            view = _view(self.optimizer, per_group)
            view.state = self.state
            with torch.no_grad():
                _unhooked_step(view)()
        for plan in plans:
            for piece in plan.pieces:
                piece.flat.grad = None
            plan.grad = None  # the reducer's shard: refilled at the next synchronising backward

    def _move_state(self, moved: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The state follows the pieces' new views (Note [Parameters in the bucket's storage])."""
        for old, new in moved:
            if old in self.state:
                self.state[new] = self.state.pop(old)

    def _step_and_gather(self, plans: List[ShardPlan], places: Dict[int, int], used: set, settled: bool) -> None:
        """Steps the buckets' shards a group at a time, first layers' first,
        and launches each group's all-gathers as soon as it is stepped
        (Note [Pipelined steps and all-gathers]): in place into the storage
        of a bucket whose parameters live in it, else through GATHER_BUFFERS
        reused buffers (launching one of those first writes the one launched
        GATHER_BUFFERS before it). Then waits for the rest, or, with the
        tail and buckets `settled` (laid out as at the last step), returns
        with them on the wire (Note [Gathering behind the next forward] in
        ddp_ext/_gather_tail.py)."""
        largest = max((p.padded for p in plans if p.storage is None and not p.replicated), default=0)
        if not largest:
            self.gather_buffers = {}  # every bucket in place: none is needed (none is in use between steps)
        launched: List[int] = []  # keys not yet written, oldest first
        buffered: List[int] = []  # those through a buffer
        copied = 0
        for group in step_groups(plans):
            self._step(group, places, used)
            for plan in group:
                # Changed as a plain step changes them: a graph that saved one fails its check in backward,
                # though they are written later (behind the next forward) or through views of the storage.
                torch.autograd.graph.increment_version([self.params[index] for index, _, _ in plan.layout])
                if plan.replicated:  # stepped whole on every rank: nothing to gather (Note [Replicated plans])
                    if plan.storage is None:
                        self._write(plan, plan.params)
                    continue
                if plan.storage is not None:
                    full, work = None, _all_gather(plan.storage, plan.params, group=self.gather_group, async_op=True)
                else:
                    if len(buffered) == GATHER_BUFFERS:  # its buffer is the oldest's: write that one first
                        self._write_gathered(buffered.pop(0))
                    full = self._gather_buffer(plan, copied % GATHER_BUFFERS, largest)
                    copied += 1
                    work = _all_gather(full, plan.params, group=self.gather_group, async_op=True)
                key = self.gathers
                self.gathers += 1
                self.gathering[key] = (plan, full, work)
                launched.append(key)
                if full is not None:
                    buffered.append(key)
        launched = [key for key in launched if key in self.gathering]
        if self.tail is None or not settled:
            for key in launched:
                self._write_gathered(key)
            return
        for key in launched:
            plan = self.gathering[key][0]
            self.tail.hold(key, [self.params[index] for index, _, _ in plan.layout])
        self.tail.begin()

    def _gather_buffer(self, plan: ShardPlan, which: int, largest: int) -> torch.Tensor:
        """One of the GATHER_BUFFERS buffers the all-gathers take turns in, of
        the largest bucket's size (allocated again when the buckets change)."""
        kind = (plan.params.dtype, plan.params.device)
        buffers = self.gather_buffers.setdefault(
            kind, [torch.empty(0, dtype=kind[0], device=kind[1])] * GATHER_BUFFERS)
        if buffers[which].numel() != largest:
            buffers[which] = torch.empty(largest, dtype=kind[0], device=kind[1])
        return buffers[which][:plan.padded]

    def _write_gathered(self, key: int) -> None:
        """Waits for one bucket's all-gather; through a buffer, writes all its parameters."""
        plan, full, work = self.gathering.pop(key)
        work.wait()
        if full is None:
            return  # in place: the parameters are written
        self._write(plan, full)

    def _write(self, plan: ShardPlan, full: torch.Tensor) -> None:
        """Writes the bucket's parameters from `full`, laid out as the bucket."""
        with torch.no_grad():
            for index, offset, numel in plan.layout:
                self.params[index].view(-1).copy_(full[offset:offset + numel])

    # --- clipping: Note [Clipping sharded gradients] in ddp_ext/_sharded_clip.py ---

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """Clips the last synchronising backward's gradient by its whole norm:
        one scalar all-reduce of the shards' sums."""
        if not self.reduced:
            raise RuntimeError(self._error(
                "clip_grad_norm_ needs the gradients of a synchronising backward, after backward() and before "
                "optimizer.step()."))
        if self.clipped:
            raise RuntimeError(self._error("clip_grad_norm_ was called already since this backward."))
        if not self.used:
            return torch.tensor(0.0)  # no rank used a parameter: the same on every rank
        norm = GlobalNorm(norm_type, self.group, self.device)
        # In the first used parameter's dtype, on every rank.
        total, edited = norm.of(self._counted(), bool(self.edits.edited()), self.params[min(self.used)].dtype)
        self._refuse_edits(elsewhere=edited)
        if error_if_nonfinite:
            norm.refuse_nonfinite(total)
        scale_by_norm([plan.grad[piece.at:piece.at + piece.stop - piece.start] for plan in self.reduced.values()
                       for piece in plan.pieces if piece.index in self.used], max_norm, total)
        self.clipped = True
        return total

    def _counted(self) -> List[torch.Tensor]:
        """The gradients this rank counts in the norm: its pieces', and of a
        replicated bucket its sharded range's only (each element once across ranks)."""
        counted = []
        for plan in self.reduced.values():
            for piece in plan.pieces:
                start, stop = plan.sharded_part(piece)
                if piece.index in self.used and start < stop:
                    counted.append(plan.grad[start - plan.lo:stop - plan.lo])
        return counted

    # --- the state: sharded inside, unsharded outside ---------------------------

    def _reshard(self, layouts: List[Tuple]) -> bool:
        """Whether the layouts are those the state is sharded by already.
        After a rebuild the state's pieces belong to the old plans: it is
        moved to the new ones' (Note [Re-cutting the state] in
        ddp_ext/_shard_recut.py). An old plan sharing no parameter with the
        new ones keeps its state (its bucket was not reduced this time).
        Every rank sees the same layouts, so every rank takes part."""
        current = set(layouts)
        if self.active is None:
            self.plans = {layout: plan for layout, plan in self.plans.items() if layout in current}
            self.active = frozenset(current)
            return False
        fresh = current - self.active
        if not fresh:
            return True
        moved = {index for layout in fresh for index, _, _ in layout}
        retired = {layout for layout in self.active if any(index in moved for index, _, _ in layout)}
        order = lambda plan: min(index for index, _, _ in plan.layout)  # noqa: E731
        began = time.perf_counter()
        whole = recut(self.state, sorted((self.plans[layout] for layout in retired), key=order),
                      sorted((self.plans[layout] for layout in fresh), key=order), self.params, self.group)
        self.loaded.update(whole)
        self.reshards += 1
        self.reshard_seconds += time.perf_counter() - began
        self.active = frozenset((self.active - retired) | current)
        self.plans = {layout: plan for layout, plan in self.plans.items() if layout in self.active}
        return False

    def _cut_loaded(self, plan: ShardPlan) -> None:
        """Cuts the unsharded state of the plan's parameters into its pieces."""
        if getattr(self, "pending", None) is not None:  # Note [Sharded checkpoints] in ddp_ext/_sharded_checkpoint.py
            self.pending.cut(plan, self)
        if not self.loaded:
            return
        for piece in plan.pieces:
            whole = self.loaded.get(piece.index)
            if whole is None:
                continue
            p = self.params[piece.index]
            self.state[piece.flat] = {key: _cut(key, value, p, piece.start, piece.stop) for key, value in whole.items()}
        for index, _, _ in plan.layout:
            self.loaded.pop(index, None)

    def _gathered(self) -> Dict[int, dict]:
        """Every parameter's unsharded state, by reducer index (a collective)."""
        mine, whole = {}, {}
        for plan in self.plans.values():
            for piece in plan.pieces:
                state = self.state.get(piece.flat)
                if state and plan.replicated:  # whole on every rank: nothing to gather
                    p = self.params[piece.index]
                    whole[piece.index] = {k: _joined([v.detach().cpu() if isinstance(v, torch.Tensor) else v], p)
                                          for k, v in state.items()}
                elif state:
                    mine[piece.key] = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                                       for k, v in state.items()}
        every = [None] * self.world_size
        dist.all_gather_object(every, mine, group=self.group)
        pieces: Dict[int, List[Tuple[int, dict]]] = {}
        for rank_pieces in every:
            for (index, start, _), state in rank_pieces.items():
                pieces.setdefault(index, []).append((start, state))
        for index, found in pieces.items():
            found.sort(key=lambda pair: pair[0])
            p = self.params[index]
            whole[index] = {key: _joined([state[key] for _, state in found], p) for key in found[0][1]}
        for index, state in self.loaded.items():
            whole.setdefault(index, state)
        return whole

    def _state_dict_post(self, optimizer, state_dict):
        """The unsharded state, under the keys a plain optimizer gives."""
        whole = self._gathered()
        numbers = {}
        count = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                numbers.setdefault(id(p), count)
                count += 1
        for index, state in whole.items():
            number = numbers.get(id(self.params[index]))
            if number is not None:
                state_dict["state"][number] = {k: (v.to(self.params[index].device) if isinstance(v, torch.Tensor)
                                                   else v) for k, v in state.items()}
        return state_dict

    def _load_state_dict_post(self, optimizer) -> None:
        """Keeps the unsharded state of the bucketed parameters to be cut into
        pieces at the next step; the optimizer holds none of it."""
        self.state = defaultdict(dict)
        self.loaded = {}
        self.active = None
        for index, p in enumerate(self.params):
            state = optimizer.state.pop(p, None)
            if state is not None:
                self.loaded[index] = state

    def state_bytes(self) -> int:
        """The bytes of the rank's optimizer state (its pieces')."""
        return sum(v.numel() * v.element_size() for state in self.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor))


def _cut(key: str, value, p: torch.Tensor, start: int, stop: int):
    whole = isinstance(value, torch.Tensor) and value.numel() == p.numel()
    if whole and (value.dim() > 0 or (p.dim() == 0 and key not in SCALAR_STATE)):
        return value.detach().reshape(-1)[start:stop].clone()
    return value.clone() if isinstance(value, torch.Tensor) else value


def _joined(values: list, p: torch.Tensor):
    first = values[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return torch.cat([v.reshape(-1) for v in values]).view(p.shape)
    return first
