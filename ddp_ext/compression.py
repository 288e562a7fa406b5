"""Adaptive-precision gradient compression, as a communication hook.

    ddp.register_comm_hook(ddp_ext.AdaptivePrecision(), ddp_ext.adaptive_precision_hook)

Each bucket is sent at full precision, float16, or 8 bits with one scale per
chunk, chosen per bucket every `check_every` iterations from statistics the
ranks agree on; what rounding drops is carried into the next iteration (error
feedback), and compression turns itself off while it costs more time than it
saves. See Note [Adaptive precision] in comm_hooks/compression/precision_policy.h.

The same line works on torch's DistributedDataParallel (the hook then runs
through Python); on ddp_ext's it runs in C++ without the GIL.
"""

from typing import List, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ddp_ext._native import core as _C
from ddp_ext._gloo_group import gloo_group

INT8_EXCHANGES = ("auto", "allgather", "reduce_scatter")
_companions = {}  # per process group (by name): companions made without a wrapper's key


def int8_exchange_for(world_size: int) -> str:
    """How 8-bit payloads travel in a world of `world_size` ranks when
    ``int8_exchange="auto"``: "allgather" up to 3 ranks, "reduce_scatter"
    from 4 (see Note [Eight bits at any world size])."""
    return _C.int8_exchange_for(world_size)


def _companion_group(group: dist.ProcessGroup, meeting: Optional[str] = None) -> Optional[dist.ProcessGroup]:
    """A Gloo group of `group`'s ranks that carries nothing else, for the
    second round of the reduce-scatter exchange (Note [Eight bits at any world
    size], Ordering); None if `group` is not known to torch.distributed (no
    store to meet in). The ranks meet under `meeting`, the key of the
    ddp_ext wrapper the hook is registered with, which every rank of its
    group agreed on at construction (ddp_ext/_diagnosis/hang.py,
    `store_key`); without one (torch's DDP), under a count of the companions
    made over `group`, made at the hook's first use, which is collective."""
    if group not in c10d._world.pg_map:
        return None
    if meeting is None:
        name = str(getattr(group, "group_name", ""))
        count = _companions.get(name, 0)
        _companions[name] = count + 1
        meeting = f"count/{count}"
    else:
        meeting = f"wrapper/{meeting}"
    store = dist.PrefixStore(f"ddp_ext_int8_companion/{meeting}/", c10d._world.pg_map[group][1])
    return gloo_group(store, group.rank(), group.size(), c10d.default_pg_timeout)


def _positive_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"AdaptivePrecision: {name} must be an integer >= {minimum}, got {value!r}")
    return value


class AdaptivePrecision:
    """State of `adaptive_precision_hook`: one per DDP model.

    Args:
        process_group: the group the DDP model reduces over. Default: on
            ddp_ext's DDP its own group, on torch's the default group.
        warmup_iterations: iterations sent at full precision first.
        check_every: iterations between decisions (the formats hold for that
            many iterations, and the ranks agree on statistics once per window).
        critical_change: relative change of a bucket's gradient norm between
            windows above which it is sent in float16 rather than 8 bits.
        reprobe_every: windows between re-measurements of the choice not taken
            (compression on or off).
        int8: allow the 8-bit format.
        int8_chunk: elements per 8-bit scale.
        int8_exchange: how 8-bit payloads travel: "allgather" (one round;
            the bytes per rank grow with the world size), "reduce_scatter"
            (two rounds; the bytes per rank do not), or "auto": allgather up
            to 3 ranks, reduce-scatter from 4 (`int8_exchange_for`).
        off_when_slower: send full precision while compression measures
            slower than it; False compresses whatever it costs.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        warmup_iterations: int = 20,
        check_every: int = 10,
        critical_change: float = 0.3,
        reprobe_every: int = 10,
        int8: bool = True,
        int8_chunk: int = 1024,
        int8_exchange: str = "auto",
        off_when_slower: bool = True,
    ):
        self.process_group = process_group
        self.warmup_iterations = _positive_int("warmup_iterations", warmup_iterations, 0)
        self.check_every = _positive_int("check_every", check_every, 1)
        self.reprobe_every = _positive_int("reprobe_every", reprobe_every, 1)
        self.int8_chunk = _positive_int("int8_chunk", int8_chunk, 1)
        if isinstance(critical_change, bool) or not isinstance(critical_change, (int, float)) or critical_change < 0:
            raise ValueError(f"AdaptivePrecision: critical_change must be a number >= 0, got {critical_change!r}")
        self.critical_change = float(critical_change)
        self.int8 = bool(int8)
        if int8_exchange not in INT8_EXCHANGES:
            raise ValueError(f"AdaptivePrecision: int8_exchange must be one of {INT8_EXCHANGES}, got {int8_exchange!r}")
        self.int8_exchange = int8_exchange
        self.off_when_slower = bool(off_when_slower)
        self._native = None
        self._companion = None

    def _bind(self, process_group: Optional[dist.ProcessGroup] = None, meeting: Optional[str] = None):
        """The native state, made on first use for `process_group` (or the
        group given at construction, or the default group); `meeting`: where
        its companion group meets (see `_companion_group`)."""
        if self.process_group is not None and process_group is not None and process_group is not self.process_group:
            raise ValueError(
                "AdaptivePrecision: this state reduces over another process group than this DDP model's; "
                "make one AdaptivePrecision per DDP model, with its process group"
            )
        if self._native is None:
            group = self.process_group if self.process_group is not None else process_group
            if group is None:
                group = dist.distributed_c10d._get_default_group()
            self.process_group = group
            policy = _C.PolicyOptions()
            policy.warmup_iterations = self.warmup_iterations
            policy.check_every = self.check_every
            policy.critical_change = self.critical_change
            policy.reprobe_every = self.reprobe_every
            policy.off_when_slower = self.off_when_slower
            exchange = int8_exchange_for(group.size()) if self.int8_exchange == "auto" else self.int8_exchange
            companion = None
            if self.int8 and exchange == "reduce_scatter":
                companion = _companion_group(group, meeting)
                if companion is None and self.int8_exchange == "reduce_scatter":
                    raise ValueError(
                        "AdaptivePrecision: int8_exchange='reduce_scatter' needs a process group made by "
                        "torch.distributed (init_process_group or new_group), to meet its companion group in"
                    )
            # Without a companion, 8 bits only where the allgather sends
            # fewer bytes than float16 (see Note [Eight bits at any world size]).
            policy.int8_allowed = self.int8 and (companion is not None or exchange == "allgather")
            self._native = _C.AdaptivePrecision(
                group, policy, self.int8_chunk, "allgather" if companion is None else exchange, companion
            )
            self._companion = companion
        return self._native

    # What the hook has done so far (zeros and empty lists before its first bucket).

    @property
    def iterations(self) -> int:
        """Synchronising iterations the hook has seen."""
        return self._native.iterations if self._native else 0

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank handed to collectives for gradient buckets."""
        return self._native.bytes_sent if self._native else 0

    @property
    def mode(self) -> str:
        """The current window's mode: warmup, compressed, full (compression
        did not pay), probe_full or probe_compressed."""
        return self._native.mode if self._native else ("warmup" if self.warmup_iterations else "compressed")

    @property
    def formats(self) -> List[str]:
        """The current window's format per bucket: fp32, fp16 or int8."""
        return list(self._native.formats) if self._native else []

    def decisions(self) -> list:
        """Every decision so far: iteration, mode, formats, and the measured
        costs (ms per iteration) of full precision and of compression."""
        return list(self._native.decisions()) if self._native else []

    @property
    def int8_exchange_used(self) -> Optional[str]:
        """How 8-bit payloads travel ("allgather" or "reduce_scatter"); None
        before the hook's first use."""
        return self._native.int8_exchange if self._native else None

    def residual(self, bucket_index: int) -> Optional[torch.Tensor]:
        """What bucket `bucket_index` still owes to later iterations (error
        feedback), in the units sent (gradients divided by the world size)."""
        return self._native.residual(bucket_index) if self._native else None

    def __getstate__(self):
        # Like torch's hook states: the options travel, the process group and
        # what was measured and owed do not; a copy starts afresh on the
        # default group (or the one its DDP model registers it with).
        state = dict(self.__dict__)
        state.update(process_group=None, _native=None, _companion=None)
        return state


def adaptive_precision_hook(state: AdaptivePrecision, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Communication hook: registered with `state`, an AdaptivePrecision."""
    # torch's DDP reads a Python hook's result as a Python object, which the
    # native future's tensor is not until a Python callback hands it on.
    return state._bind().run(bucket).then(_value)


def _value(future):
    return future.value()
