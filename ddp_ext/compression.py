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

from ddp_ext import _C

# Up to this many ranks the 8-bit format moves fewer bytes than float16 (each
# rank receives every other rank's payload); see Note [Adaptive precision].
INT8_MAX_WORLD_SIZE = 3


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
        int8: allow the 8-bit format (used only with up to 3 ranks).
        int8_chunk: elements per 8-bit scale.
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
        self.off_when_slower = bool(off_when_slower)
        self._native = None

    def _bind(self, process_group: Optional[dist.ProcessGroup] = None):
        """The native state, made on first use for `process_group` (or the
        group given at construction, or the default group)."""
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
            policy.int8_allowed = self.int8 and group.size() <= INT8_MAX_WORLD_SIZE
            policy.off_when_slower = self.off_when_slower
            self._native = _C.AdaptivePrecision(group, policy, self.int8_chunk)
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

    def residual(self, bucket_index: int) -> Optional[torch.Tensor]:
        """What bucket `bucket_index` still owes to later iterations (error
        feedback), in the units sent (gradients divided by the world size)."""
        return self._native.residual(bucket_index) if self._native else None

    def __getstate__(self):
        # Like torch's hook states: the options travel, the process group and
        # what was measured and owed do not; a copy starts afresh on the
        # default group (or the one its DDP model registers it with).
        state = dict(self.__dict__)
        state.update(process_group=None, _native=None)
        return state


def adaptive_precision_hook(state: AdaptivePrecision, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Communication hook: registered with `state`, an AdaptivePrecision."""
    # torch's DDP reads a Python hook's result as a Python object, which the
    # native future's tensor is not until a Python callback hands it on.
    return state._bind().run(bucket).then(_value)


def _value(future):
    return future.value()
